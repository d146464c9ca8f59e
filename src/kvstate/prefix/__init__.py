"""kvstate.prefix"""
