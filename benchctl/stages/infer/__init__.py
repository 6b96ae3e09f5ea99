"""Stage `infer`: what recurrent depth costs and saves when a finished model generates; its latent state."""
