"""Fault tolerance across replica groups (torchft): the quorum, commit and heal that init and
the step ask for."""
