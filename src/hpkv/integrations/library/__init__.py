"""hpkv as a library: :class:`~hpkv.integrations.library.store.KVStore` and the in-process copies
under it and under SGLang's backend (:mod:`~hpkv.integrations.library.local`)."""
