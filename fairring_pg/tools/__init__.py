"""Command-line tools beside the backend: ``fairring-plan``
(:mod:`~fairring_pg.tools.plan_command`) and ``fairring-timeline``
(:mod:`~fairring_pg.tools.timeline_command`)."""
