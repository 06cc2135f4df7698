"""dragon's version: the package's (setup.cfg reads it), run.json's and every model card's."""

__version__ = "0.3.0.dev0"
