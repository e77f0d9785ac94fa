"""The CUDA side of the creator: who runs collectives on CUDA tensors
(:mod:`~fairring_pg.cuda.decision`), what each machine is made of
(:mod:`~fairring_pg.cuda.node_facts`), the plan of the job's CUDA allreduces
(:mod:`~fairring_pg.cuda.job_plan`) and the sub-groups they are composed of
(:mod:`~fairring_pg.cuda.subgroups`)."""
