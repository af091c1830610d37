"""Benchmark suite: `python -m longattn.bench {list,run,dist,scale,report}`."""
