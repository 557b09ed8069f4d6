"""The ``hpkv`` command line."""
