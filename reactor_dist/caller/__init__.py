"""caller"""
