"""kvstate.semantic"""
