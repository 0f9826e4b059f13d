"""Training steps in mixed precision: the gradient module (grad + the plan's pipeline), loss
scaling, the f32 optimizers and the per-step incidence report (docs/training.md).

Sits above backend and report (it runs modules and counts what rounding did) and below cli.
"""
