"""Lightning + Hydra glue: ``python -m tasks.run experiment=<task>/<row>``; one folder per benchmark."""
