"""Temperature-scaled knowledge distillation into a smaller student."""
