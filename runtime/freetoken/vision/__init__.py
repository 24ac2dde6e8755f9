"""Image inputs for vision-language models: decoding and preprocessing images the way the
model's HF image processor does (`preprocess`), and the records the server hands the engine
(`inputs`). The vision tower itself lives with the other forward code in `models/`."""
