"""The language-model floor every stage stands on: the ladder's architecture (:mod:`.model`), the
transformers loading lock, tokenizers and their adapters (:mod:`.tokenizer`), the perplexity
evaluator (:mod:`.loss`), token windows (:mod:`.windows`), MiniLM embeddings (:mod:`.embeddings`) and
where SmolLM2 lives (:mod:`.smollm2`). It imports only :mod:`tasks.common` and :mod:`kernels`."""
