"""The package version, in one place (``ditops.__version__``, ``ditops --version``)."""

__version__ = "0.1.0"
