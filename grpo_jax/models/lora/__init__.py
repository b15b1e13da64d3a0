"""LoRA on the native decoder: adapters (attach/adapt/merge), the loop's LoRA policy, PEFT export."""
