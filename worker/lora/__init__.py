"""LoRA adapters in the worker: PEFT loading, the host LRU, the device slots, the LoRA-aware
linears and the per-step metadata (``manager.LoRAManager`` ties them together)."""
