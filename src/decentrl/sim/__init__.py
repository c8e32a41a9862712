"""A discrete-event simulator of a decentrl run (`decentrl bench simulate`) and its cost models."""
