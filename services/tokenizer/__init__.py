"""The tokenizer service: chat template, encode, prompt page hashes."""
