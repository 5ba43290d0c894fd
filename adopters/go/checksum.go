package pdpolicy

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math"
)

// Magic opens the canonical encoding (format 1).
var Magic = []byte("PDPOL\x00\x01\x00")

// CanonicalBytes is the byte encoding the checksum covers, bit for bit the one of
// controller/policy/checksum.py (docs/policy-format.md, "Checksum"): little-endian, floats
// as IEEE-754 binary64 with -0.0 written as 0.0; the busy overrides are appended only when
// on, so a policy without them keeps the checksum it had before they existed.
func CanonicalBytes(p *Policy) []byte {
	n := len(p.Routes)
	size := len(Magic) + 3*4 + 8*(len(p.Axes.ContextTokens)+len(p.Axes.IORatio)+
		len(p.Axes.QPS)) + 17*n + 16 + 1 + 8 + 1 + 8
	b := make([]byte, 0, size)
	b = append(b, Magic...)
	for _, edges := range [][]float64{p.Axes.ContextTokens, p.Axes.IORatio, p.Axes.QPS} {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(edges)))
		for _, e := range edges {
			b = appendF64(b, e)
		}
	}
	for i := 0; i < n; i++ {
		b = append(b, byte(p.Routes[i]))
		b = appendF64(b, p.Scores[i])
		b = appendF64(b, p.Exploration[i])
	}
	b = appendF64(b, p.WTFT)
	b = appendF64(b, p.WTPOT)
	b = append(b, byte(p.Overrides.FirstTurnRoute))
	b = binary.LittleEndian.AppendUint64(b, p.Overrides.BypassAppendTokens)
	b = append(b, byte(p.Default))
	o := p.Overrides
	if o.LaterTurnBusyWaiting != 0 {
		b = binary.LittleEndian.AppendUint32(b, o.FirstTurnBusyWaiting)
		b = binary.LittleEndian.AppendUint32(b, o.LaterTurnBusyWaiting)
	} else if o.FirstTurnBusyWaiting != 0 {
		b = binary.LittleEndian.AppendUint32(b, o.FirstTurnBusyWaiting)
	}
	return b
}

// Checksum is the hex sha256 of CanonicalBytes.
func Checksum(p *Policy) string {
	sum := sha256.Sum256(CanonicalBytes(p))
	return hex.EncodeToString(sum[:])
}

func appendF64(b []byte, x float64) []byte {
	if x == 0 { // -0.0 and 0.0 encode alike
		x = 0
	}
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(x))
}
