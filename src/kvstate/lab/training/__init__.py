"""kvstate.lab.training — training of the small reference models (``kvstate train``), their ``kvstate eval``
command, and the replay of a model's recorded training (``kvstate lab retrain``)."""
