"""Scorers: reward scores, reference log-probs and critic values, full-sequence or streamed."""
