"""Engine integrations (vLLM connector, ...). They sit on top of ``hpkv.engine``."""
