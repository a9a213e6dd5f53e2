"""Model runner: config, loaders (safetensors, GGUF), the Llama-family decoder, RoPE and tokenizer."""
