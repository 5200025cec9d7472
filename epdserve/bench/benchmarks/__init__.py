"""The benchmarks `epd-bench` runs, one module each, and what they share (`rounds`: interleaved
rounds; `results`: the JSON they write; `towers`: the bench towers, small or full size)."""
