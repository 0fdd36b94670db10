// pcm16 (16-bit little-endian, the Realtime wire's audio) <-> base64, as the JSON events carry it.
export function pcm16ToBase64(pcm) {
  const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  let binary = "";
  const step = 0x8000; // String.fromCharCode takes its arguments on the stack: a slice at a time
  for (let i = 0; i < bytes.length; i += step) binary += String.fromCharCode(...bytes.subarray(i, i + step));
  return btoa(binary);
}

// base64 pcm16 -> float samples in [-1, 1) for an AudioBuffer.
export function base64ToFloat32(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer);
  const samples = new Float32Array(bytes.length >> 1);
  for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 0x8000;
  return samples;
}
