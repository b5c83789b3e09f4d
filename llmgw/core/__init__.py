"""The pure domain: catalog, inventory, placement and the reconcile planner.

Nothing here does I/O, awaits, or reads the clock: time is passed in, so every decision
can be replayed in a unit test over plain data.
"""
