#!/usr/bin/env bash
# Quiet (and busy-neighbour) reruns for issue 39, one at a time, in /work/main.
set -u
cd /work/main && . .venv/bin/activate && export PYTHONPATH=src
P=benchmarks/cpu/probes; O=benchmarks/cpu/quiet-1205; mkdir -p $O
rm -rf ~/.cache/ditops
step() { local name=$1; shift; echo "## $name: $* | start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $O/LOG; "$@" > $O/$name.txt 2>&1; echo "   rc=$? end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $O/LOG; }
spin_on() { python -c "while True: pass" & SPIN=$!; sleep 2; }
spin_off() { kill $SPIN; wait $SPIN 2>/dev/null; sleep 3; }
step wan_norms_busy python $P/wan_norms_busy.py --rounds 3
step small_shapes-fast python $P/small_shapes.py --calls 20 --rounds 101
step small_shapes-exact python $P/small_shapes.py --calls 20 --rounds 101 --precision exact
step sparse_share_groups python $P/sparse_share_groups.py --rounds 5
step estimate_workers python $P/estimate_workers.py --rounds 7
step permute_cost python $P/permute_cost.py --rounds 5
spin_on
step sparse_share_groups-busy python $P/sparse_share_groups.py --rounds 3
step estimate_workers-busy python $P/estimate_workers.py --rounds 5
step permute_cost-busy python $P/permute_cost.py --rounds 3
spin_off
step wan-main-job python -m ditops bench --no-progress --plot '' --json $O/wan-main-job.json
echo done | tee -a $O/LOG
