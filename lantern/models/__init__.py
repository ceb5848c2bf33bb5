"""Model definitions: the LlamaGen-compatible GPT, its EAGLE-style drafter and the VQ tokenizer."""
