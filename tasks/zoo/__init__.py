"""The model zoo: every model a stage writes, on disk and back. :func:`.models.load_causal_lm` loads
any of them (a trained ladder folder, :mod:`.ladder`; a compressed file, :mod:`.compressed` with the
methods' decoders in :mod:`.decoders`; a pruned or any ``from_pretrained`` folder; SmolLM2), and
the MLflow pyfunc (:mod:`.mlflow_model`) calls it. It imports only :mod:`tasks.lm`,
:mod:`tasks.common` and :mod:`kernels`."""
