"""Export of trained stages to a Hugging Face model folder."""
