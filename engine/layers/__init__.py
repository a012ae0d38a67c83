"""Model building blocks shared by the model definitions (norm, rotary, activation, fused linear)."""
