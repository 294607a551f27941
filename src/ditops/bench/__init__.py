"""The benchmark harness and suites behind `ditops bench`."""
