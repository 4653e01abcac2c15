"""What a launched process may use: events, reports, stacks."""
