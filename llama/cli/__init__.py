"""The command line: the `llama` command (`main`), what every program of the package shares (`common`), the
terminal chat and its input (`chat`, `chat_input`), and the `demo` and `convert` commands."""
