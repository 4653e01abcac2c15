"""What travels with a job: namespace analysis, packaging, results back."""
