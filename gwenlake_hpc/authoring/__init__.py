"""What a training function declares about itself: the decorator's data (``api``: ``TrainFunction``, the registry
of decorated functions), its bindings (``bindings``), its resources (``resources``) and short fits
(``short_fit``). The public ``@train`` (:mod:`gwenlake_hpc.decorator`, :mod:`gwenlake_hpc.transforms`) builds on
it; the job reads it. Imports the runtime, the stores and the basics only."""
