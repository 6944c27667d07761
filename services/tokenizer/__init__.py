"""The tokenizer service: chat template, encode, prompt block hashes."""
