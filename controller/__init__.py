"""pd-controller: closes the control loop of prefill/decode-disaggregated LLM serving."""

__version__ = "0.1.0"
