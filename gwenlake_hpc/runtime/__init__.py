"""The Run and what it owns inside a training process: the loop (``run``), what it feeds (``feed``), and the objects
it is composed of (its time accumulators ``timing``, metrics ``run_metrics``, checkpoints ``run_checkpoints``), the
current run (``current``), RNG state (``rng``), stop signals (``signals``), the process group (``distributed``),
progress lines (``progress``) and the device (``device``). Imports the stores and the basics only."""
