"""Fitting RidgeFill maps: capture through llama.cpp, running sums, closed-form ridge solve."""
