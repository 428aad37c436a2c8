"""What outlives a process, on disk and in services: ``checkpoints``, ``data`` (the dataset catalog),
``versioning`` (models as git commits), ``registry`` (aliases, MLflow's registry) and ``tracking`` (MLflow through
a spool and a delivery process). They never import the Run, the job, the decorator or the release gate."""
