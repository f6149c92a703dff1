"""
GPTError, the error of a model setting or input that the user can fix; scripts print it on one line (common.py).

It has a module of its own so that model.py and the modules below it (sampling.py, hf_gpt2.py) raise the same error
without importing each other; it must import nothing from the project.
"""


class GPTError(ValueError):
    """A model setting or input the user can fix; scripts print it as a one-line error."""
