"""Hugging Face models in and out: a model directory as a born-sharded init source (hf_import),
a live model or checkpoint as a directory `transformers` loads (hf_export), and where a run's
model config comes from (model_source)."""
