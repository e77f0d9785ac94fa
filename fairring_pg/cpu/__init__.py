"""The CPU side's Python: the mark that keeps the allreduces issued from future
callbacks on the CPU engine's callback pipeline (:mod:`~fairring_pg.cpu.future_callbacks`).
The CPU plan is the model's (fairring_pg.model.cpu_plan)."""
