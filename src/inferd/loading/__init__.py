"""From `--model` to a model in memory: resolve the name, check the untrusted files, read GGUF or
Hugging Face weights under our names, build and quantize the model.

    loader.py   --model -> files -> LlamaModel (GGUF, Hugging Face folder or dummy weights); dtype
                rules; the quantization route
    checks.py   bounds every untrusted file is held to before it is parsed for real
    gguf.py     GGUF metadata -> ModelConfig, tensors -> our parameter names

The GGUF format itself (one reader, no torch) is inferd.gguf_file: the tokenizer and the bench
read it too, below this package.
"""
