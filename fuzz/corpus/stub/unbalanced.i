[]
[Models
= x
[ ]
