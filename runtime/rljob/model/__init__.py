"""The model side shared by trainers and engines: the built-in tiny model, the character
tokenizer and text codec, and moving a process's GPU tensors to host memory and back."""
