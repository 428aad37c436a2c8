"""One job, from a composed config to the training function's return: typed settings (``config``), the plan
(``plan``), execution (``execute``), the end of a start (``finish``), ``fit.local()`` (``local``) and the
container a start runs in (``run_environment``). Never imports a launcher."""
