"""An example decentrl plug-in: the "count-letters" task (letters.py)."""
