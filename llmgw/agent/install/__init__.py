"""Getting engines and models onto a node."""
