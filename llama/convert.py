"""`python -m llama.convert`: the same as `llama convert` (convert or quantize a checkpoint; `llama.cli.convert`)."""

from llama.cli.convert import main

if __name__ == "__main__":
    main()
