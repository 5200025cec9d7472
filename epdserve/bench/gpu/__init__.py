"""``make gpu-check``: the encode worker measured on a lent GPU in one run of at most six minutes,
written so that a run stopped anywhere leaves every finished step's answer behind.

  python3 -m epdserve.bench.gpu OUT_DIR              # on the GPU machine: CUDA, bfloat16
  python3 -m epdserve.bench.gpu OUT_DIR --dry-run    # small towers on the CPU (the tests' run)

* ``supervisor`` (the entry; the standard library only): installs the wheels the machine lacks
  (``.whl/``), runs the preflight, then the steps in a child process it can abandon: each step
  has its own timeout and the run a hard budget; a step past its time is killed and reported,
  and a new child goes on with the next. ``OUT_DIR/summary.json`` says after every event what
  ran, what was skipped or abandoned and why;
* ``preflight``: the machine (python, torch, CUDA, GPU, Triton, C compiler, ``/dev/shm``, NVML,
  each package the steps need) and so what can run;
* ``plan``: the steps, in order of importance, with their timeouts and needs;
* ``runner`` and ``steps``: the child, and the measurements, each step's JSON written into
  ``OUT_DIR/steps/`` as it goes (after every size it measured) and when it ends;
* ``flops``: the forward's FLOPs for a batch and the cards' peaks (achieved TFLOP/s, % of peak).
"""
