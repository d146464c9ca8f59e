"""kvstate.eval"""
